//! Keeping blocking work off the async runtime's workers.

use crate::error::{Error, ErrorKind, Result};

/// Makes the C allocator hand large buffers back to the system when they are freed. Fetch
/// runs and chunks (256 KiB to a few MiB) come and go all the time; by default glibc raises its
/// mmap threshold after the first such buffer is freed and from then on keeps them in
/// per-thread arenas, so a process that served a 10 GiB disk held 71 MiB at its peak; with a
/// fixed threshold and two arenas it held 28 MiB and went back to 15 MiB. Called once at start,
/// before the runtime's threads exist. (`unsafe`: glibc has no safe binding. The crate's
/// `unsafe` is here, in [`at_idle_io`], in `format::seekable::zran`, zlib's inflate state
/// driven block by block, and where a FUSE connection changes hands: descriptors received
/// (`snapshotter::servers::keeper`, `snapshotter::mount_server`), swapped under a session
/// (`serve::connection`) and registrations an earlier server made (`serve::fuse`).)
#[allow(unsafe_code)]
pub fn return_large_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is called before any other thread
    // of this process is started, and a refused setting leaves the default.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// Runs `work` on this thread in the idle I/O priority class: its disk reads wait while
/// others' are queued (the BFQ scheduler honours the class; others take it as a hint), so
/// background reads of the cache (re-verification after a restart) do not slow a guest's.
/// The thread's class is put back afterwards: blocking threads are reused. (`unsafe`: neither
/// libc nor rustix binds ioprio safely.)
#[allow(unsafe_code)]
pub fn at_idle_io<T>(work: impl FnOnce() -> T) -> T {
    // IOPRIO_WHO_PROCESS with 0: the calling thread (I/O priorities are per thread).
    const THIS_THREAD: [libc::c_long; 2] = [1, 0];
    const IDLE: libc::c_long = 3 << 13;
    // SAFETY: ioprio_get takes two integers and returns one; it touches no memory of ours.
    let before = unsafe { libc::syscall(libc::SYS_ioprio_get, THIS_THREAD[0], THIS_THREAD[1]) };
    // SAFETY: ioprio_set takes three integers; it touches no memory of ours.
    let set =
        unsafe { libc::syscall(libc::SYS_ioprio_set, THIS_THREAD[0], THIS_THREAD[1], IDLE) } == 0;
    let out = work();
    if set && before >= 0 {
        // SAFETY: as above; `before` is the class this thread had.
        unsafe { libc::syscall(libc::SYS_ioprio_set, THIS_THREAD[0], THIS_THREAD[1], before) };
    }
    out
}

/// Runs blocking file-system, store or CPU-heavy work on the runtime's blocking threads.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::new(ErrorKind::Io, "a blocking task panicked").with_source(e))?
}

/// Runs CPU- or disk-bound `work` that borrows from its caller (decompressing, hashing and
/// writing chunks) without holding up the runtime's other tasks: on a multi-threaded runtime
/// the worker first hands its queue to another thread. Elsewhere (single-threaded test
/// runtimes) it simply runs.
pub fn off_the_runtime<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}
