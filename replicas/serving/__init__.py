"""The Serve replica around the engine: the async engine thread, the deployment, its metrics and logs."""
