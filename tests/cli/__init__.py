"""The `kvcupy` command, the README and docs checks, a new user's first hour, the
bench library, the check sample, and the test tools (--shard, tools/)."""
