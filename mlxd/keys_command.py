"""`mlxd keys add|list|revoke|loras|curve`."""

from __future__ import annotations

import datetime
import sys


def main(args) -> int:
    from mlxd.shared import keys as k

    path = getattr(args, "keys_file", None) or k.default_keys_file()
    if args.verb == "add":
        key = k.add_key(path, args.app, args.loras)
        print(f"key of {args.app} (shown only now; clients send 'Authorization: Bearer KEY'):",
              file=sys.stderr)
        print(key)
    elif args.verb == "list":
        for entry in k.read_keys(path).keys:
            created = datetime.datetime.fromtimestamp(entry.created).isoformat(timespec="seconds")
            loras = "any adapter" if entry.loras is None else "adapters: " + (", ".join(entry.loras) or "none")
            print(f"{entry.app}\tmlxd_{entry.key_id}_...\t{created}\t{loras}")
    elif args.verb == "revoke":
        if not k.revoke_key(path, args.app):
            print(f"mlxd: app {args.app!r} has no key", file=sys.stderr)
            return 1
        if not k.read_keys(path).keys:
            print("mlxd: no app has a key now; gateways refuse every request (but --api-key's) "
                  "until `mlxd keys add` makes one", file=sys.stderr)
    elif args.verb == "loras":
        if args.any and args.names:
            print("mlxd: give adapter names or --any, not both", file=sys.stderr)
            return 2
        if not k.set_loras(path, args.app, None if args.any else args.names):
            print(f"mlxd: app {args.app!r} has no key", file=sys.stderr)
            return 1
    else:
        from mlxd.shared.curve import default_curve_dir, make_keys

        directory = make_keys(args.dir or default_curve_dir())
        print(f"CurveZMQ keys in {directory}: pass --curve-keys {directory} to the engine and the gateways",
              file=sys.stderr)
    return 0
