// Prefill: move the run state to the next prompt token (prepended: state.wgsl). One thread.
// A prefill chunk records its prompt tokens back to back in one pass; between two tokens this
// kernel sets token = prompt[step + 1], pos += 1, step += 1 (the argmax kernel's job in decode).
@group(0) @binding(0) var<storage, read_write> st: State;
@group(0) @binding(1) var<storage, read> prompt: array<u32>;   // [chunk] this chunk's token ids

@compute @workgroup_size(1)
fn main() {
    if (st.done != 0u) { return; }
    var s = st;
    s.step += 1u;
    s.pos += 1u;
    // The host records at most chunk - 1 advances per chunk; the clamp keeps the read in bounds.
    s.token = prompt[min(s.step, arrayLength(&prompt) - 1u)];
    st = s;
}
