//! The real `ramlog server` process for tests. The binary is looked up beside the test executable
//! (`target/<profile>/ramlog`), which `cargo build` of the workspace produces (scripts/test builds
//! everything first). When it is missing, tests fail under CI (`CI` set) and otherwise say so on
//! stderr and return without checking anything.

use ramlog_client::{Client, ClientConfig, Error};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn ramlog_binary() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let profile_dir = exe.parent()?.parent()?;
    let bin = profile_dir.join("ramlog");
    bin.exists().then_some(bin)
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct ServerProcess {
    child: Child,
    pub bin: PathBuf,
    pub native_port: u16,
    pub admin_port: u16,
    data_dir: PathBuf,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}

impl ServerProcess {
    /// Starts `ramlog server` (256 MiB) with `extra` flags and waits until its native port answers;
    /// None (after saying so) when the binary is missing outside CI.
    pub async fn start(extra: &[&str]) -> Option<ServerProcess> {
        let Some(bin) = ramlog_binary() else {
            let message = "the ramlog binary is not built next to the tests: \
                           run `cargo build -p ramlog` with the same profile first";
            if std::env::var_os("CI").is_some() {
                panic!("{message}");
            }
            eprintln!("{message} (skipping)");
            return None;
        };
        let (resp_port, native_port, admin_port) = (free_port(), free_port(), free_port());
        let data_dir = std::env::temp_dir().join(format!(
            "ramlog-client-test-{}-{native_port}",
            std::process::id()
        ));
        std::fs::create_dir_all(&data_dir).unwrap();
        let child = Command::new(&bin)
            .arg("server")
            .args(["--resp-port", &resp_port.to_string()])
            .args(["--native-port", &native_port.to_string()])
            .args(["--admin-port", &admin_port.to_string()])
            .args(["--data-dir", data_dir.to_str().unwrap()])
            .args(["--memory", "256MiB"])
            .args(extra)
            .env_remove("RAMLOG_PASSWORD")
            .env_remove("RAMLOG_CONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start ramlog server");
        let server = ServerProcess {
            child,
            bin,
            native_port,
            admin_port,
            data_dir,
        };
        // Wait until the native port answers a handshake.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let mut probe = ClientConfig::new(server.addr());
            probe.connect_timeout = Duration::from_millis(500);
            match Client::connect(probe).await {
                Ok(_) | Err(Error::AuthFailed(_)) => break,
                Err(e) if Instant::now() > deadline => panic!("server did not come up: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        Some(server)
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
