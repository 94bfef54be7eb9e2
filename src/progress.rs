//! What a long command has done so far (`push`, `convert`, `index`, `preheat`, `prefetch
//! --wait`), shown on stderr and never on stdout, where commands print what scripts read: on a
//! terminal a progress bar (indicatif) with what is done of the total, the rate and the time
//! left; elsewhere (a pipe, a CI log) the same as one plain line every [`LINE_EVERY`], so a
//! slow registry shows as a slow rate rather than as silence; with `--quiet`, nothing.

use std::io::{IsTerminal, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often a line is printed where stderr is not a terminal.
pub const LINE_EVERY: Duration = Duration::from_secs(5);

/// How progress is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Display {
    /// A bar redrawn in place (stderr is a terminal).
    Bar,
    /// A line every [`LINE_EVERY`] and one at the end (a pipe, a log).
    Lines,
    /// Nothing (`--quiet`).
    Off,
}

impl Display {
    /// What fits this process's stderr; `quiet`: nothing.
    pub fn for_stderr(quiet: bool) -> Self {
        match (quiet, std::io::stderr().is_terminal()) {
            (true, _) => Display::Off,
            (false, true) => Display::Bar,
            (false, false) => Display::Lines,
        }
    }

    /// Starts showing the progress of `what` (e.g. "pushing disk.qcow2"), counted in `unit`;
    /// its total is set when known ([`Progress::set_total`]).
    pub fn start(self, what: impl Into<String>, unit: Unit) -> Progress {
        let what = what.into();
        let bar = match self {
            Display::Off => return Progress::off(),
            Display::Bar => ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr()),
            Display::Lines => ProgressBar::hidden(),
        };
        bar.set_style(unit.style());
        bar.set_message(what.clone());
        let stop = Arc::new(AtomicBool::new(false));
        match self {
            Display::Bar => bar.enable_steady_tick(Duration::from_millis(200)),
            _ => {
                let (bar, stop, what) = (bar.clone(), Arc::clone(&stop), what.clone());
                std::thread::spawn(move || loop {
                    std::thread::park_timeout(LINE_EVERY);
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    eprintln!("{what}: {}", unit.line(&bar));
                });
            }
        }
        Progress(Some(Arc::new(Shown {
            bar,
            unit,
            display: self,
            what,
            stop,
        })))
    }
}

/// What is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Bytes,
    Chunks,
}

impl Unit {
    fn style(self) -> ProgressStyle {
        let template = match self {
            Unit::Bytes => {
                "{msg} {wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} {eta} left"
            }
            Unit::Chunks => "{msg} {wide_bar} {pos}/{len} chunks {per_sec} {eta} left",
        };
        ProgressStyle::with_template(template).expect("the templates are valid")
    }

    fn amount(self, n: u64) -> String {
        match self {
            Unit::Bytes => format!("{}", indicatif::BinaryBytes(n)),
            Unit::Chunks => format!("{n} chunks"),
        }
    }

    /// One line of where `bar` stands: done of total, rate, time left.
    fn line(self, bar: &ProgressBar) -> String {
        let done = bar.position();
        let rate = bar.per_sec();
        let rate = match self {
            Unit::Bytes => format!("{}/s", indicatif::BinaryBytes(rate as u64)),
            Unit::Chunks => format!("{rate:.0} chunks/s"),
        };
        match bar.length() {
            Some(total) if total > 0 => format!(
                "{} of {} ({:.0}%), {rate}, {} left",
                self.amount(done),
                self.amount(total),
                100.0 * done as f64 / total as f64,
                indicatif::HumanDuration(bar.eta())
            ),
            _ => format!("{}, {rate}", self.amount(done)),
        }
    }
}

struct Shown {
    bar: ProgressBar,
    unit: Unit,
    display: Display,
    what: String,
    /// Tells the line printer to stop.
    stop: Arc<AtomicBool>,
}

impl Drop for Shown {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if self.display == Display::Bar {
            self.bar.finish_and_clear();
        }
    }
}

/// The progress of one task, shared by whoever does parts of it; does nothing when off.
#[derive(Clone, Default)]
pub struct Progress(Option<Arc<Shown>>);

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(s) => write!(f, "Progress({:?}, {})", s.display, s.what),
            None => f.write_str("Progress(off)"),
        }
    }
}

impl Progress {
    /// Shows nothing.
    pub fn off() -> Self {
        Progress(None)
    }

    /// The total, once known.
    pub fn set_total(&self, total: u64) {
        if let Some(s) = &self.0 {
            s.bar.set_length(total);
        }
    }

    /// `n` more done.
    pub fn inc(&self, n: u64) {
        if let Some(s) = &self.0 {
            s.bar.inc(n);
        }
    }

    /// `done` done (a task started again from the beginning, a polled count).
    pub fn set(&self, done: u64) {
        if let Some(s) = &self.0 {
            s.bar.set_position(done);
        }
    }

    /// `reader`, each byte read from it counted as done.
    pub fn reader<R: Read>(&self, reader: R) -> Counted<R> {
        Counted {
            inner: reader,
            progress: self.clone(),
        }
    }

    /// The task ended: in lines, a last one with what was done and how long it took.
    pub fn finish(self) {
        if let Some(s) = &self.0 {
            s.stop.store(true, Ordering::Release);
            if s.display == Display::Bar {
                // Cleared before the command prints its result.
                s.bar.finish_and_clear();
            }
            if s.display == Display::Lines {
                eprintln!(
                    "{}: done, {} in {:.1} s",
                    s.what,
                    s.unit.amount(s.bar.position()),
                    s.bar.elapsed().as_secs_f64()
                );
            }
        }
    }
}

/// A reader whose bytes count as done ([`Progress::reader`]).
pub struct Counted<R> {
    inner: R,
    progress: Progress,
}

impl<R> Counted<R> {
    /// The reader it counts for.
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// Counts `n` bytes as done that were not read through it (skipped, known).
    pub fn count(&self, n: u64) {
        self.progress.inc(n);
    }
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.progress.inc(n as u64);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_says_what_is_done_of_the_total_and_off_counts_nothing() {
        let bar = ProgressBar::hidden();
        bar.set_length(4 << 20);
        bar.set_position(1 << 20);
        let line = Unit::Bytes.line(&bar);
        assert!(line.starts_with("1.00 MiB of 4.00 MiB (25%), "), "{line}");
        assert!(line.ends_with(" left"), "{line}");
        let off = Progress::off();
        let mut read = off.reader(&b"abc"[..]);
        let mut out = Vec::new();
        read.read_to_end(&mut out).unwrap();
        assert_eq!(out, b"abc");
        assert!(off.0.is_none());
    }
}
