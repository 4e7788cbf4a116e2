//! The real `ramlog server` process for tests. The binary is looked up beside the test executable
//! (`target/<profile>/ramlog`), which `cargo build` of the workspace produces (scripts/test builds
//! everything first). When it is missing, every test that needs it fails and says how to build it:
//! a test that checked nothing must not pass.

use ramlog_client::{Client, ClientConfig, Error};
use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The `ramlog` binary beside the test executable; panics, saying how to build it, when it is missing.
pub fn ramlog_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test executable lies in target/<profile>/deps");
    let bin = profile_dir.join("ramlog");
    assert!(
        bin.exists(),
        "the ramlog binary is not built at {}: run `cargo build --workspace` with the same profile \
         (e.g. `cargo build --release --workspace --all-targets`) before these tests",
        bin.display()
    );
    bin
}

/// A loopback port nothing listens on, never one this test process handed out before: the kernel
/// may give back a port it just gave, and tests run in parallel threads, so without the record two
/// servers could be told the same port (and a readiness probe would reach the wrong one).
pub fn free_port() -> u16 {
    static HANDED_OUT: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if HANDED_OUT.lock().unwrap().insert(port) {
            return port;
        }
    }
}

pub struct ServerProcess {
    child: Child,
    pub bin: PathBuf,
    pub resp_port: u16,
    pub native_port: u16,
    pub admin_port: u16,
    pub data_dir: PathBuf,
    extra: Vec<String>,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}

/// `ramlog server` on the (resp, native, admin) ports and `data_dir`, 256 MiB, with `extra` flags.
fn server_command(bin: &Path, ports: [u16; 3], data_dir: &Path, extra: &[String]) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("server")
        .args(["--resp-port", &ports[0].to_string()])
        .args(["--native-port", &ports[1].to_string()])
        .args(["--admin-port", &ports[2].to_string()])
        .args(["--data-dir", data_dir.to_str().unwrap()])
        .args(["--memory", "256MiB"])
        .args(extra)
        .env_remove("RAMLOG_PASSWORD")
        .env_remove("RAMLOG_CONFIG")
        .stdout(Stdio::null());
    cmd
}

impl ServerProcess {
    /// Starts `ramlog server` (256 MiB) with `extra` flags and waits until its native port answers.
    /// Panics when the binary is missing (see [`ramlog_binary`]).
    pub async fn start(extra: &[&str]) -> ServerProcess {
        let bin = ramlog_binary();
        let (resp_port, native_port, admin_port) = (free_port(), free_port(), free_port());
        let data_dir = std::env::temp_dir().join(format!(
            "ramlog-client-test-{}-{native_port}",
            std::process::id()
        ));
        std::fs::create_dir_all(&data_dir).unwrap();
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let child = server_command(
            &bin,
            [resp_port, native_port, admin_port],
            &data_dir,
            &extra,
        )
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start ramlog server");
        let mut server = ServerProcess {
            child,
            bin,
            resp_port,
            native_port,
            admin_port,
            data_dir,
            extra,
        };
        server.wait_ready().await;
        server
    }

    /// The server command line: same ports, data directory and flags every time.
    fn command(&self) -> Command {
        server_command(
            &self.bin,
            [self.resp_port, self.native_port, self.admin_port],
            &self.data_dir,
            &self.extra,
        )
    }

    async fn wait_ready(&mut self) {
        // Wait until the native port answers a handshake, and fail at once if the server exited
        // (a port taken by another process would otherwise be probed instead).
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("ramlog server exited before it was ready: {status}");
            }
            let mut probe = ClientConfig::new(self.addr());
            probe.connect_timeout = Duration::from_millis(500);
            match Client::connect(probe).await {
                Ok(_) | Err(Error::AuthFailed(_)) => break,
                Err(e) if Instant::now() > deadline => panic!("server did not come up: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// Kills the server (SIGKILL) and waits until it is gone; [`ServerProcess::restart`] starts
    /// it again.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the killed server again on the same data directory and ports.
    pub async fn restart(&mut self) {
        assert!(
            self.child.try_wait().unwrap().is_some(),
            "restart of a server that still runs"
        );
        self.child = self
            .command()
            .stderr(Stdio::inherit())
            .spawn()
            .expect("restart ramlog server");
        self.wait_ready().await;
    }

    /// Kills the server (SIGKILL) and starts it again on the same data directory and ports.
    pub async fn kill_and_restart(&mut self) {
        self.kill();
        self.restart().await;
    }

    /// Kills the server and starts it again, expecting it to refuse to start: its output.
    pub fn kill_and_start_expecting_failure(&mut self) -> Output {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut cmd = self.command();
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("start ramlog server");
        let deadline = Instant::now() + Duration::from_secs(20);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the server started although it should have refused");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        child.wait_with_output().unwrap()
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.native_port)
    }

    /// Runs a `ramlog` CLI verb against this server.
    pub fn cli(&self, args: &[&str]) -> Output {
        let port = self.native_port.to_string();
        let admin = self.admin_port.to_string();
        let mut cmd = Command::new(&self.bin);
        cmd.args(args).args(["--port", &port]);
        if args[0] == "status" {
            cmd.args(["--admin-port", &admin]);
        }
        cmd.env_remove("RAMLOG_PASSWORD")
            .env_remove("RAMLOG_NATIVE_PORT")
            .output()
            .expect("run ramlog")
    }
}
