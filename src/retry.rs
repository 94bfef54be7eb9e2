//! The one retry policy. Every fetch whose bytes are verified (manifests, configs, TOCs,
//! indexes, windows, chunks) and every idempotent registry request is retried here and
//! nowhere else: a transient failure — no connection, a reset, a timeout, a 5xx or 429, a
//! short body, bytes that fail their digest — is tried again with exponential backoff and
//! jitter (`backon`), until it succeeds, the attempts run out or the overall deadline passes;
//! anything else (not found, refused credentials, a malformed answer) fails at once. A
//! failure that says how long to wait ([`RetryAfter`]: a registry's 429 or 503 with
//! `Retry-After`) is not tried again sooner, within the deadline. Which
//! endpoint a try goes to (the next mirror first, the registry itself last) is the registry
//! client's business; this module only decides whether and when to try again.

use std::time::Duration;

use backon::{ExponentialBuilder, Retryable as _};

use crate::error::{Error, ErrorKind, Result};

/// How often, how patiently and for how long to retry.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Total tries, at least 1.
    pub attempts: u32,
    pub base_delay: Duration,
    pub max_delay: Duration,
    /// Nothing retried here runs past this, tries and waits included.
    pub deadline: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: 5,
            base_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(5),
            deadline: Duration::from_secs(60),
        }
    }
}

/// How long the remote side asked to be left alone (`Retry-After` on a 429 or 503), carried as
/// the source of the error of that answer: the next try waits at least that long.
#[derive(Debug, Clone, Copy)]
pub struct RetryAfter(pub Duration);

impl std::fmt::Display for RetryAfter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "asked to wait {:.1} s (Retry-After)",
            self.0.as_secs_f32()
        )
    }
}

impl std::error::Error for RetryAfter {}

impl RetryAfter {
    /// The longest wait asked for of a `Retry-After` header's value in seconds (an HTTP date is
    /// not read: the backoff stands).
    pub const LONGEST: Duration = Duration::from_secs(120);

    /// The wait a `Retry-After` header's value asks for, if it is a number of seconds (at most
    /// [`RetryAfter::LONGEST`]).
    pub fn parse(value: &str) -> Option<Self> {
        let secs: u64 = value.trim().parse().ok()?;
        Some(RetryAfter(Duration::from_secs(secs).min(Self::LONGEST)))
    }

    /// The wait `e` (or one of its causes) asks for.
    pub fn of(e: &Error) -> Option<Duration> {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
        while let Some(c) = cause {
            if let Some(RetryAfter(wait)) = c.downcast_ref::<RetryAfter>() {
                return Some(*wait);
            }
            cause = c.source();
        }
        None
    }
}

/// Whether a failure may go away by itself: network trouble and bytes that were not what was
/// asked for (cut, flipped, from a confused mirror).
pub fn transient(e: &Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Network | ErrorKind::Corrupt | ErrorKind::Timeout
    )
}

impl RetryPolicy {
    /// For bytes that failed their check after their fetch succeeded: `attempts` tries at once
    /// (the fetch under each try has waited and retried already), with no deadline of its own —
    /// the caller's (a read's `fetch_timeout`, a mount's `--timeout`) bounds it.
    pub fn checked(attempts: u32) -> Self {
        RetryPolicy {
            attempts,
            base_delay: Duration::ZERO,
            max_delay: Duration::ZERO,
            deadline: Duration::MAX,
        }
    }

    /// For registry requests (manifests, blobs, a Range of an endpoint) of a client whose
    /// requests may take `deadline` in all: the default tries and waits.
    pub fn registry(deadline: Duration) -> Self {
        RetryPolicy::default().with_deadline(deadline)
    }

    /// For one range of a blob a read needs: tried until `deadline` (a read's fetch deadline),
    /// however many tries that takes, waiting at most 2 s between them — a reader waits for a
    /// flaky link rather than fail.
    pub fn demand_range(deadline: Duration) -> Self {
        RetryPolicy {
            attempts: u32::MAX,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(2),
            deadline,
        }
    }

    /// For a check of bytes with no digest of their own (the regions between chunks, a
    /// layer's whole stream): bytes flipped on the way fail a try as a lie would, but a fault is
    /// random and a lie the same every time, so a check fails only after six tries, all within
    /// `deadline`.
    pub fn recheck(deadline: Duration) -> Self {
        RetryPolicy {
            attempts: 6,
            base_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(1),
            deadline,
        }
    }

    /// For background work a mount owns for its whole life (a background hydration): tried
    /// again after any transient failure, every 10 s at first and every 5 minutes at most,
    /// until it succeeds or the mount ends — a congested or failing registry pauses it, never
    /// ends it.
    pub fn background() -> Self {
        RetryPolicy {
            attempts: u32::MAX,
            base_delay: Duration::from_secs(10),
            max_delay: Duration::from_secs(300),
            deadline: Duration::MAX,
        }
    }

    /// For unit tests against servers on loopback: 4 tries, 10 to 50 ms apart, within 45 s.
    #[cfg(test)]
    pub fn quick() -> Self {
        RetryPolicy {
            attempts: 4,
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(50),
            deadline: Duration::from_secs(45),
        }
    }

    /// This policy with another overall deadline.
    pub fn with_deadline(&self, deadline: Duration) -> Self {
        RetryPolicy {
            deadline,
            ..self.clone()
        }
    }

    /// Runs `op` until it succeeds or fails with an error that is not [`transient`], at most
    /// `attempts` times and within `deadline`; `what` names the operation in logs and errors.
    pub async fn run<T, F, Fut>(&self, what: &str, op: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        self.run_when(what, op, transient).await
    }

    /// [`RetryPolicy::run`] that retries the failures `retry` accepts.
    pub async fn run_when<T, F, Fut>(
        &self,
        what: &str,
        op: F,
        retry: impl Fn(&Error) -> bool,
    ) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let backoff = ExponentialBuilder::new()
            .with_min_delay(self.base_delay)
            .with_max_delay(self.max_delay)
            .with_max_times(self.attempts.max(1) as usize - 1)
            .with_jitter();
        let last = parking_lot::Mutex::new(None::<String>);
        let tries = op
            .retry(backoff)
            .sleep(tokio::time::sleep)
            .when(|e| retry(e))
            .adjust(|e, wait| wait.map(|w| RetryAfter::of(e).map_or(w, |asked| asked.max(w))))
            .notify(|e, wait| {
                if e.kind() == ErrorKind::Corrupt {
                    tracing::warn!(what, error = %e.chain(), retry_in_ms = wait.as_millis() as u64, "bytes failed their check; fetching them again");
                } else {
                    tracing::info!(what, error = %e.chain(), retry_in_ms = wait.as_millis() as u64, "failed; retrying");
                }
                *last.lock() = Some(e.chain());
            });
        match tokio::time::timeout(self.deadline, tries).await {
            Ok(outcome) => outcome,
            Err(_) => {
                let last = last.lock().take();
                let why = last.map_or_else(
                    || "no answer".to_string(),
                    |e| format!("the last try failed: {e}"),
                );
                Err(Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "{what} did not succeed within {} s ({why})",
                        self.deadline.as_secs_f32()
                    ),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn quick(attempts: u32, deadline_ms: u64) -> RetryPolicy {
        RetryPolicy {
            attempts,
            base_delay: Duration::from_millis(1),
            max_delay: Duration::from_millis(5),
            deadline: Duration::from_millis(deadline_ms),
        }
    }

    /// A failure that asks for a wait (a 429 with Retry-After) is tried again no sooner, though
    /// the backoff would have.
    #[tokio::test]
    async fn a_retry_after_is_waited_for() {
        let tries = AtomicU32::new(0);
        let started = std::time::Instant::now();
        quick(3, 5000)
            .run("a busy registry", || async {
                match tries.fetch_add(1, Ordering::SeqCst) {
                    0 => Err(Error::new(ErrorKind::Network, "HTTP 429")
                        .with_source(RetryAfter(Duration::from_millis(400)))),
                    _ => Ok(()),
                }
            })
            .await
            .unwrap();
        assert_eq!(tries.load(Ordering::SeqCst), 2);
        assert!(
            started.elapsed() >= Duration::from_millis(400),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            RetryAfter::parse(" 3 ").map(|r| r.0),
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            RetryAfter::parse("100000").map(|r| r.0),
            Some(RetryAfter::LONGEST)
        );
        assert!(RetryAfter::parse("Wed, 21 Oct 2015 07:28:00 GMT").is_none());
    }

    #[tokio::test]
    async fn transient_failures_are_retried_and_others_are_not() {
        let tries = AtomicU32::new(0);
        let got = quick(5, 5000)
            .run("a flaky fetch", || async {
                match tries.fetch_add(1, Ordering::SeqCst) {
                    0 => Err(Error::corrupt("digest mismatch")),
                    1 => Err(Error::new(ErrorKind::Network, "reset")),
                    _ => Ok(7),
                }
            })
            .await
            .unwrap();
        assert_eq!((got, tries.load(Ordering::SeqCst)), (7, 3));

        let tries = AtomicU32::new(0);
        let e = quick(5, 5000)
            .run("a refused fetch", || async {
                tries.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(Error::new(ErrorKind::Auth, "401"))
            })
            .await
            .unwrap_err();
        assert_eq!(
            (e.kind(), tries.load(Ordering::SeqCst)),
            (ErrorKind::Auth, 1)
        );

        // Attempts run out: the last error is returned as it was.
        let tries = AtomicU32::new(0);
        let e = quick(3, 5000)
            .run("always corrupt", || async {
                tries.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(Error::corrupt("blob sha256:ab does not match"))
            })
            .await
            .unwrap_err();
        assert_eq!(tries.load(Ordering::SeqCst), 3);
        assert!(e.chain().contains("sha256:ab"), "{e}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_deadline_bounds_tries_and_waits_and_names_the_last_failure() {
        let e = quick(1000, 2000)
            .run("config sha256:cd", || async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Err::<(), _>(Error::new(ErrorKind::Network, "connection reset"))
            })
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Timeout);
        let text = e.chain();
        assert!(
            text.contains("config sha256:cd") && text.contains("connection reset"),
            "{text}"
        );
        // A silent peer: nothing to name but the silence.
        let e = quick(1000, 2000)
            .run("manifest", || async {
                std::future::pending::<()>().await;
                Ok(())
            })
            .await
            .unwrap_err();
        assert!(e.chain().contains("no answer"), "{e}");
    }
}
