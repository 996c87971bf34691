//! Fuzz target: `levee_gateway::fuzzing::sse_stream` (see its invariants there).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    levee_gateway::fuzzing::sse_stream(data);
});
