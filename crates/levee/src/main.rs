//! The `levee` binary: a thin command-line layer over the levee crates.

mod drain;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

/// The process allocator, chosen for the gateway: each waiting HTTP/1.1 client holds hyper's
/// two 8 KiB connection buffers, of which a queued request touches only the first page or so;
/// jemalloc leaves the untouched pages out of RSS, glibc malloc does not (10 000 queued
/// requests: 97 MB with jemalloc against 152 MB with glibc when it was chosen; see
/// docs/benchmarks-history.md, "Gateway overhead"). It lives in the
/// binary, not the gateway library, so that embedders keep their own allocator.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "levee",
    version,
    about = "Overload protection for LLM inference"
)]
struct Cli {
    /// Log lines on standard error: `text` (coloured only on a terminal) or `json` (one
    /// object per line, for a log collector).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway.
    Serve(levee_gateway::ServeArgs),
    /// Run one simulated GPU inference server.
    Engine(levee_engine::EngineArgs),
    /// Flood a target with a scenario and write reports.
    Sim(Box<levee_sim::SimArgs>),
    /// Drain a running gateway and wait for its in-flight requests (a preStop hook).
    Drain(drain::DrainArgs),
    /// The whole story in one command: simulated engines, a flood, unprotected versus levee.
    Drill(levee_drill::DrillArgs),
    /// Configuration tools.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Validate a configuration file and explain every error by its path.
    Check {
        /// The TOML file to check.
        file: PathBuf,
    },
}

/// `observe.otlp_endpoint` of the config `levee serve` will load, read ahead so the trace
/// layer is in place before the gateway starts. A config that does not load gives `None`
/// here; `serve` then reports its errors.
#[cfg(feature = "otel")]
fn otlp_endpoint(command: &Command) -> Option<String> {
    match command {
        Command::Serve(args) => levee_gateway::Config::load(&args.config)
            .ok()
            .and_then(|c| c.observe.otlp_endpoint),
        _ => None,
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    #[cfg(feature = "otel")]
    let mut otel_exporter: Option<levee_gateway::otel::OtelExporter> = None;
    let filter = |default: &str| {
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default))
    };
    if let Command::Drill(args) = &cli.command {
        // The drill tells its story on the terminal; the in-process gateway's and engines'
        // logs go to a file beside its reports, never over the progress and the tables.
        let log = args.out.join("drill.log");
        let file = std::fs::create_dir_all(&args.out).and_then(|()| std::fs::File::create(&log));
        match file {
            Ok(file) => tracing_subscriber::fmt()
                .with_env_filter(filter("info"))
                .with_ansi(false)
                .with_writer(std::sync::Mutex::new(file))
                .init(),
            Err(e) => {
                eprintln!(
                    "levee drill: cannot create the log file {}: {e}",
                    log.display()
                );
                return ExitCode::FAILURE;
            }
        }
    } else {
        use std::io::IsTerminal;
        use tracing_subscriber::layer::SubscriberExt;
        use tracing_subscriber::util::SubscriberInitExt;
        use tracing_subscriber::Layer;
        // Colours only for a person at a terminal: a log collector would store the escapes.
        let text = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal());
        let logs = match cli.log_format {
            LogFormat::Text => text.boxed(),
            LogFormat::Json => text.json().boxed(),
        }
        .with_filter(filter("info"));
        let registry = tracing_subscriber::registry().with(logs);
        #[cfg(feature = "otel")]
        {
            let otel = match otlp_endpoint(&cli.command) {
                Some(url) => match levee_gateway::otel::layer(&url) {
                    Ok((layer, exporter)) => {
                        otel_exporter = Some(exporter);
                        Some(layer)
                    }
                    Err(e) => {
                        eprintln!("levee: {e}");
                        return ExitCode::FAILURE;
                    }
                },
                None => None,
            };
            registry.with(otel).init();
        }
        #[cfg(not(feature = "otel"))]
        registry.init();
    }
    if let Command::Config {
        command: ConfigCommand::Check { file },
    } = &cli.command
    {
        return match levee_gateway::check_config_file(file) {
            Ok(summary) => {
                println!("{}: ok\n{summary}", file.display());
                ExitCode::SUCCESS
            }
            Err(errors) => {
                for e in &errors {
                    eprintln!("{}: {e}", file.display());
                }
                ExitCode::FAILURE
            }
        };
    }
    // `serve --event-loops N` runs its own single-threaded loops ([`levee_gateway::serve_cli`]):
    // this thread's is the first. Everything else runs on tokio's work-stealing runtime.
    let mut builder = match &cli.command {
        Command::Serve(a) if a.event_loops > 0 => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("levee: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => levee_gateway::serve_cli(args).await,
            Command::Engine(args) => levee_engine::run_cli(args).await,
            Command::Sim(args) => levee_sim::run_cli(*args).await,
            Command::Drill(args) => levee_drill::run_cli(args).await,
            Command::Drain(args) => drain::run_cli(args).await,
            Command::Config { .. } => Ok(()),
        }
    });
    #[cfg(feature = "otel")]
    if let Some(exporter) = otel_exporter {
        // The last batch of spans goes out before the process ends.
        if let Err(e) = exporter.shutdown() {
            eprintln!("levee: {e}");
        }
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("levee: {e:#}");
            ExitCode::FAILURE
        }
    }
}
