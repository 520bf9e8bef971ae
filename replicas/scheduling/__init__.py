"""What runs when, and where its KV lives: the scheduler's policies and budgets, the paged block
manager and prefix cache, the pass-time model and the load figures a replica reports (no torch)."""
