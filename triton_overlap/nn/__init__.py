"""torch.nn layers built on the ops (tensor-parallel linear layers land here; see the issue tracker)."""
