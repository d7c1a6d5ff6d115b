//! The attention's sequence split: how many positions each chunk workgroup takes for a step of
//! `n` positions, the bound the host dispatches and sizes the partials by, and the same rule as
//! WGSL (`chunk_len`) for the kernels.

/// How the sequence is split, fixed per kernel: chunk length `chunk_len(n)` for `n` positions is
/// `min` while `ceil(n / target) <= min`, else `ceil(n / target)` rounded up to whole tiles,
/// capped at `max`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Split {
    /// Chunks per kv head aimed at.
    pub target: u32,
    /// Minimum chunk length (`params.chunk`).
    pub min: u32,
    /// Maximum chunk length (>= min).
    pub max: u32,
    /// Positions per shared-memory tile.
    pub tile: u32,
    /// Cache rows.
    pub ctx: u32,
}

impl Split {
    /// Chunk length used for `n >= 1` positions (mirrors `chunk_len` in the WGSL prelude; the
    /// GPU computes it, the host only in tests).
    #[cfg(test)]
    pub fn chunk_len(&self, n: u32) -> u32 {
        let x = n.div_ceil(self.target);
        if x <= self.min {
            return self.min;
        }
        (x.div_ceil(self.tile) * self.tile).min(self.max)
    }

    /// Chunks used for `n >= 1` positions.
    #[cfg(test)]
    pub fn chunks(&self, n: u32) -> u32 {
        n.div_ceil(self.chunk_len(n))
    }

    /// An upper bound of [`Self::chunks`] over every `n <= nb`: chunks never exceed
    /// `ceil(n / min)`, nor `target` while the length is below the cap, nor `ceil(n / max)` at it.
    pub fn chunks_bound(&self, nb: u32) -> u32 {
        nb.div_ceil(self.min)
            .min(self.target.max(nb.div_ceil(self.max)))
    }

    /// Partial slots per query head (the most chunks any position of the cache uses).
    pub fn slots(&self) -> u32 {
        self.chunks_bound(self.ctx).max(1)
    }

    pub(super) fn wgsl(&self) -> String {
        format!(
            "fn chunk_len(n: u32) -> u32 {{
    let x = (n + {t}u - 1u) / {t}u;
    if (x <= {lo}u) {{ return {lo}u; }}
    return min((x + {p}u - 1u) / {p}u * {p}u, {hi}u);
}}
",
            t = self.target,
            p = self.tile,
            lo = self.min,
            hi = self.max
        )
    }
}
