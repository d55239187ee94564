"""The `mlxd` command: the top of the project, above the engine, the gateway, the service and bench."""
