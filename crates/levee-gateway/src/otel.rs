//! OpenTelemetry trace export (cargo feature `otel`).
//!
//! The request path is instrumented with `tracing` spans in every build (see
//! [`crate::routes`]): one `request` span per public request, with a child span per phase
//! (`authenticate`, `classify`, `admit`, `dispatch`, `proxy`, `settle`). This module turns
//! those spans into OpenTelemetry spans, batched and sent as OTLP/HTTP protobuf to
//! `observe.otlp_endpoint`, by way of a `tracing-subscriber` layer the process installs
//! beside its log layer:
//!
//! ```no_run
//! # fn demo() -> Result<(), levee_gateway::otel::OtelError> {
//! use tracing_subscriber::layer::SubscriberExt;
//! use tracing_subscriber::util::SubscriberInitExt;
//! let (layer, exporter) = levee_gateway::otel::layer("http://127.0.0.1:4318")?;
//! tracing_subscriber::registry().with(layer).init();
//! // ... serve ...
//! exporter.shutdown()?; // sends what is still batched
//! # Ok(()) }
//! ```
//!
//! Only the gateway's spans and events (at `debug` or above) are exported; the
//! exporter's HTTP client runs on the batch processor's own thread, outside any request.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::{Filtered, Targets};
use tracing_subscriber::Layer;

/// The path OTLP/HTTP collectors take traces on.
const TRACES_PATH: &str = "/v1/traces";

/// What went wrong setting up or stopping the exporter.
#[derive(Debug, thiserror::Error)]
pub enum OtelError {
    /// The OTLP exporter could not be built (bad URL, HTTP client failure).
    #[error("cannot set up OTLP trace export to {url}: {message}")]
    Build {
        /// The traces URL it was built for.
        url: String,
        /// The exporter's own message.
        message: String,
    },
    /// Flushing or stopping the batch processor failed (collector unreachable, timeout).
    #[error("OTLP trace export did not finish cleanly: {0}; traces still batched may be lost")]
    Shutdown(String),
}

/// The `tracing` layer that exports levee's spans, filtered to levee's own targets.
pub type OtelLayer<S> = Filtered<
    tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>,
    Targets,
    S,
>;

/// Owns the batch exporter; call [`OtelExporter::shutdown`] before the process exits so the
/// last batch is sent.
#[derive(Debug)]
pub struct OtelExporter {
    provider: SdkTracerProvider,
}

impl OtelExporter {
    /// Sends every span batched so far and waits for the collector's answer.
    pub fn flush(&self) -> Result<(), OtelError> {
        self.provider
            .force_flush()
            .map_err(|e| OtelError::Shutdown(e.to_string()))
    }

    /// Sends what is still batched, then stops the exporter's thread.
    pub fn shutdown(self) -> Result<(), OtelError> {
        self.provider
            .shutdown()
            .map_err(|e| OtelError::Shutdown(e.to_string()))
    }
}

/// A layer exporting levee's request spans to the collector at `endpoint` (its OTLP/HTTP
/// base URL; `/v1/traces` is appended), and the handle that flushes it.
pub fn layer<S>(endpoint: &str) -> Result<(OtelLayer<S>, OtelExporter), OtelError>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    let url = format!("{}{TRACES_PATH}", endpoint.trim_end_matches('/'));
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url.clone())
        .build()
        .map_err(|e| OtelError::Build {
            url,
            message: e.to_string(),
        })?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name("levee").build())
        .build();
    let tracer = provider.tracer("levee");
    // The request spans are at `debug`, so a build or a process without this layer does not
    // create them (the log layer's default filter is `info`).
    let targets = Targets::new().with_target("levee_gateway", tracing::Level::DEBUG);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(targets);
    Ok((layer, OtelExporter { provider }))
}
