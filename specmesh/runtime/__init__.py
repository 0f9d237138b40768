"""The target model at run time: loading, runtimes, KV sessions, and the tree verifier."""
