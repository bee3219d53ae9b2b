//! The OTLP exporter and the tracer provider built from [`ExportSettings`]: spans are
//! batched on the tokio runtime and sent over http/protobuf (reqwest) or gRPC (tonic).

use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::runtime::Tokio;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};

use super::{ExportSettings, Protocol, SamplerSetting, Spans, TraceSettings};
use crate::error::ConfigError;

/// Export turned on: the provider that batches and sends the spans, and the span maker.
pub struct Exporting {
    provider: SdkTracerProvider,
    spans: Spans,
    endpoint: String,
}

/// How long an export call may take before it is given up (spans are dropped, never
/// retried forever: a collector's outage must not hold the relayer back).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

fn sampler(s: SamplerSetting) -> Sampler {
    match s {
        SamplerSetting::AlwaysOn => Sampler::AlwaysOn,
        SamplerSetting::AlwaysOff => Sampler::AlwaysOff,
        SamplerSetting::Ratio(r) => Sampler::TraceIdRatioBased(r),
        SamplerSetting::ParentBasedAlwaysOn => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
        SamplerSetting::ParentBasedAlwaysOff => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
        SamplerSetting::ParentBasedRatio(r) => {
            Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(r)))
        }
    }
}

/// Starts exporting spans as `settings` say, on the current tokio runtime; `None` when
/// export is off. The exporter connects on its first export, not here.
pub fn install(settings: &TraceSettings) -> Result<Option<Exporting>, ConfigError> {
    let Some(export) = &settings.export else {
        return Ok(None);
    };
    // reqwest and tonic over TLS need a crypto provider: the process's one is ring.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = exporter(export)?;
    let processor = BatchSpanProcessor::builder(exporter, Tokio).build();
    let resource = Resource::builder_empty()
        .with_service_name(export.service_name.clone())
        .with_attributes(
            export
                .resource
                .iter()
                .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
        )
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(sampler(export.sampler))
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("outbox-relay");
    Ok(Some(Exporting {
        spans: Spans::new(tracer, settings.parent_first_attempt),
        provider,
        endpoint: export.endpoint.clone(),
    }))
}

fn exporter(export: &ExportSettings) -> Result<opentelemetry_otlp::SpanExporter, ConfigError> {
    let built = match export.protocol {
        Protocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(format!("{}/v1/traces", export.endpoint))
            .with_timeout(EXPORT_TIMEOUT)
            .build(),
        Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(export.endpoint.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build(),
    };
    built.map_err(|e| ConfigError::new("OTEL_EXPORTER_OTLP_ENDPOINT", e.to_string()))
}

impl Exporting {
    /// The span maker every dispatcher of the process shares.
    pub fn spans(&self) -> Spans {
        self.spans.clone()
    }

    /// Where spans go (for the start-up log line).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Sends the spans still batched and stops the exporter (at shutdown), giving up after
    /// the export timeout.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || provider.shutdown());
        match tokio::time::timeout(EXPORT_TIMEOUT, done).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => {
                tracing::warn!(error = %e, "span export: flushing at shutdown failed")
            }
            Ok(Err(_)) | Err(_) => {
                tracing::warn!("span export: flushing at shutdown did not finish")
            }
        }
    }
}
