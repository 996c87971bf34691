//! levee-client: retry and backoff policy for clients of levee.
