"""`mlxd service`: the engine and a gateway as background services that restart after a crash.

launchd LaunchAgents on macOS (launchctl.py), systemd user units on Linux
(systemd.py); the plist and unit templates are in templates/.
"""
