//! nibble-engine (being written).
