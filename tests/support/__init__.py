"""What the tests share: real prompts, the multiple-choice set, a server started as a user starts it.

The load tests and benchmarks read the same prompts from here (`loadtests` imports
`tests.support`; the product never does)."""
