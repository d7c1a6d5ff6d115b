// The run-state buffer every decode kernel reads (one per run, written only by the GPU's argmax /
// advance step): current position, current token, done flag (EOS seen), step index.
struct State { pos: u32, token: u32, done: u32, step: u32 };
