"""Copy-engine producers (gather, scatter) and the protocol of a call they share (pipeline)."""
