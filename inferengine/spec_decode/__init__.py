"""Draft-token proposers for speculative decoding (DESIGN.md: the proposer writes
`request.spec_token_ids`; the scheduler schedules them; the rejection sampler verifies them)."""
