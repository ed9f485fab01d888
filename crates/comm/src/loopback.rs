//! What the tests that run a rendezvous on this machine set up: a runtime and a free port.

/// A two-thread runtime, as a process's engine runs its connections on.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
}

/// A loopback port nothing listens on now (the OS's pick, released for the test to bind).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}
