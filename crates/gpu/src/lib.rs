//! nibble-gpu (being written).
