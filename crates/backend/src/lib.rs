//! nibble-backend (being written).
