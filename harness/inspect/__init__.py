"""`ckpt-harness inspect DIR` and `ckpt-harness check-load DIR --to TOPO`: what a user's checkpoint
is, whether its files are whole, and whether a load at another topology finds every key, read from
metadata only (torch DCP's `.metadata`, safetensors headers, JSON/YAML records), never tensor data.
docs/inspect.md."""
