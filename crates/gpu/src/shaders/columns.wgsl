// Per-column state of a multi-column run (columns.rs): column c of every [B, ...] activation is one
// token: of its own sequence (multi-stream decode: own KV slot, position, token chain) or of one
// prompt (batched prefill: one slot, consecutive positions). Kernels skip a column whose `done` is
// set; `slot` picks the column's KV-cache region (`slot * ctx` rows into the layer's cache).
struct Col { pos: u32, token: u32, done: u32, step: u32, slot: u32, pad0: u32, pad1: u32, pad2: u32 };
