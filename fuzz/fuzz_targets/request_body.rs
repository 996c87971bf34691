//! Fuzz target: `levee_gateway::fuzzing::request_body` (see its invariants there).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    levee_gateway::fuzzing::request_body(data);
});
