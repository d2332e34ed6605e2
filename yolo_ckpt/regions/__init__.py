"""Which layers a training step recomputes, and how: the plan, its grammar, the model's graph, the recompute."""
