//! The attention's tunable shape: the split's and tiles' constants, the chunk body's form
//! ([`AttnForm`], [`ChunkShape`]) and where the chunk partials merge ([`Combine`]).

use crate::context::Context;

/// Chunk workgroups (chunks x kv heads) the split aims for once the context is long: ~8 per SM
/// of a big GPU (132 on an H200), while the combine stays a short reduction. Chunk + combine at
/// position 4096 on the H200: 38.2 us at 512, 33.4 at 1024, 44.3 at 2048 (docs/BENCHMARKS.md
/// run 25); shorter contexts alike.
pub(super) const TARGET_WORKGROUPS: u32 = 1024;
/// Preferred cap on the chunk length (the score buffer of a chunk lives in shared memory).
pub(super) const CHUNK_CAP: u32 = 256;
/// Most chunks per kv head the fused combine merges ([`Combine::Fused`]): its last workgroup
/// walks them serially (~0.3 us each), so past this the separate combine dispatch, which
/// spreads them over every query head's workgroup, is faster. H200 (BENCHMARKS runs 33-39):
/// kernel_bench fused vs dispatch 12.7 vs 13.2 us at 8 chunks (pos 128), 21.6 vs 14.6 at 32;
/// whole token, limit 16 against 8 at depth 128 (9-16 chunks): 278.2 / 278.0 vs 278.1 / 278.1
/// tok/s (even); limit 16 against 32 at depth 256 (17-24 chunks): 277.5 / 278.5 vs 270.0 /
/// 269.2 (the dispatch pair 3% faster there).
pub const FUSED_MAX_CHUNKS: u32 = 16;
/// Cap on the positions of one shared-memory tile.
pub(super) const TILE_CAP: u32 = 64;
/// Cache loads per thread per tile (the tile holds `TILE_LOADS * WG / (D/4)` rows): two keeps
/// each thread's loads in flight together without a long register-held batch.
pub const TILE_LOADS: u32 = 2;
/// V rows per thread per batch of the streamed form (loads in flight per thread).
pub const V_ROWS: u32 = 4;

/// How a chunk workgroup moves its cache rows: the `attend` body appended to attention.wgsl.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnForm {
    /// attention_tiles.wgsl: K, then V, through shared-memory tiles; one thread per (head,
    /// position) scores, one per (head, vec4) sums V.
    #[default]
    Tiles,
    /// attention_stream.wgsl: K blocks through shared memory one block ahead in registers, each
    /// key read once for several heads; V straight from the cache into registers, every head
    /// summed per thread.
    Stream,
}

/// The chunk body's shape: its form, cache loads per thread per tile (key block, streamed) and
/// the streamed form's V rows per thread per batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkShape {
    pub form: AttnForm,
    /// 1..=16 ([`TILE_LOADS`] by default): a tile holds `tile_loads * WG / (D/4)` rows (at most
    /// 64).
    pub tile_loads: u32,
    /// 1..=16 ([`V_ROWS`] by default; streamed form only).
    pub v_rows: u32,
}

impl Default for ChunkShape {
    fn default() -> Self {
        ChunkShape {
            form: AttnForm::default(),
            tile_loads: TILE_LOADS,
            v_rows: V_ROWS,
        }
    }
}

/// Where the chunk partials are merged once a position needs several chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Combine {
    /// A `combine` dispatch after the chunks: two dispatches per layer (any backend).
    Dispatch,
    /// Inside the chunk dispatch, by the last chunk workgroup of each kv head to finish
    /// (`fused` in attention.wgsl: an atomic arrival count between device-scope barriers):
    /// one dispatch per layer. Vulkan only, where naga's `storageBarrier` is a device-scope
    /// acquire/release and the partials are `@coherent`; Metal's and D3D's translations promise
    /// less, so they keep the dispatch ([`Context::publishes_across_workgroups`]).
    Fused,
}

impl Combine {
    /// The default for `ctx`'s backend: [`Combine::Fused`] where workgroups can publish to each
    /// other (Vulkan), else [`Combine::Dispatch`].
    pub fn for_context(ctx: &Context) -> Combine {
        if ctx.publishes_across_workgroups() {
            Combine::Fused
        } else {
            Combine::Dispatch
        }
    }
}
