"""What a training step recomputes, and how: the plan a user writes, its grammar, the model's layer graph, the regions
on layers and on the loss, installing them, the recompute."""
