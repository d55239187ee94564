"""`mlxd service`: the engine and a gateway as background services that restart after a crash.

launchd LaunchAgents on macOS (launchd.py), systemd user units on Linux
(systemd.py), chosen in managers.py; what both install is in jobs.py, the
plist and unit templates in templates/.
"""
