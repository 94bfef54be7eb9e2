//! How vmdisk's programs log: to stderr, filtered by a level or `target=level` directives,
//! with colours only when stderr is a terminal (journald and log files get plain text).
//! A level that is not one is refused at start-up: `EnvFilter` would read `verbose` as a
//! target name and silently log nothing, errors included.

use std::io::IsTerminal as _;

use crate::error::{Error, Result};

const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// The filter `directives` name: a level, or comma-separated directives each ending in
/// `=<level>` (`info,vmdisk::engine=debug`).
pub fn filter(directives: &str) -> Result<tracing_subscriber::EnvFilter> {
    for d in directives
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
    {
        let level = d.rsplit_once('=').map_or(d, |(_, l)| l);
        if !LEVELS.contains(&level.to_ascii_lowercase().as_str()) {
            return Err(Error::invalid(format!(
                "log level {d:?} is not one of {} (or target=level directives such as \"info,vmdisk::engine=debug\")",
                LEVELS.join(", ")
            )));
        }
    }
    tracing_subscriber::EnvFilter::try_new(directives)
        .map_err(|e| Error::invalid(format!("log level {directives:?}: {e}")))
}

/// Logs to stderr with `directives` (fuser's own messages at error unless named).
pub fn init(directives: &str) -> Result<()> {
    let directives = if directives.contains("fuser") {
        directives.to_string()
    } else {
        format!("{directives},fuser=error")
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter(&directives)?)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_directives_are_accepted_and_anything_else_refused() {
        for ok in [
            "info",
            "WARN",
            "info,vmdisk::engine=debug",
            "off",
            "h2=warn,debug",
        ] {
            assert!(filter(ok).is_ok(), "{ok}");
        }
        for bad in ["verbose", "info,loud", "vmdisk=chatty", "vmdisk::engine"] {
            let e = filter(bad).unwrap_err();
            assert!(e.to_string().contains("is not one of"), "{bad}: {e}");
        }
    }
}
