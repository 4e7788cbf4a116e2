//! Runs the `ramlog bench backup` suite without the `ramlog` binary:
//! `cargo run --release -p ramlog-backup --example bench_backup -- [--quick] [--json FILE]`.

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let json = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1))
        .map(std::path::PathBuf::from);
    ramlog_bench::backup::run(quick, json.as_deref())
}
