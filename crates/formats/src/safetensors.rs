//! safetensors reader (single file and sharded) and writer. Placeholder: being written.
