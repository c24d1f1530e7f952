"""The ``spherical-kv`` command: ``demo`` here, and the subcommands other packages register
under the entry-point group ``spherical_kv.commands`` (``evaluate``, from ``spherical_kv_eval``)."""
from __future__ import annotations

import argparse
import sys

import numpy as np


def _positive(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {n}")
    return n


def demo_parser() -> argparse.ArgumentParser:
    """The options of ``spherical-kv demo``."""
    p = argparse.ArgumentParser(prog="spherical-kv demo", description=demo.__doc__)
    p.add_argument("--dim", type=_positive, default=128,
                   help="head dimension d of the random keys and values (default 128)")
    p.add_argument("--tokens", type=_positive, default=2048,
                   help="how many random keys and values to encode (default 2048)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random data and of the codecs' rotations (default 0)")
    return p


def demo(argv=None) -> int:
    """Encode random keys/values at each bit width; print bytes, logit errors and bounds."""
    from . import SphericalCodec, attention, dense_attention
    from .rotation import VALUE_SALT

    a = demo_parser().parse_args(argv)
    rng = np.random.default_rng(a.seed)
    k = rng.standard_normal((a.tokens, a.dim)) + rng.standard_normal(a.dim)
    v = rng.standard_normal((a.tokens, a.dim))
    q = rng.standard_normal((4, a.dim))
    exact = dense_attention(q, k, v)
    print(f"{'bits':>4} {'bytes/vec':>9} {'vs bf16':>8} {'E[eps^2]':>9} "
          f"{'mean|dlogit|':>12} {'mean bound':>11} {'attn rel err':>12}")
    for bits in (2, 3, 4, 8, 16):
        kc = SphericalCodec(a.dim, bits, a.seed)
        vc = SphericalCodec(a.dim, bits, a.seed, salt=VALUE_SALT)
        ke, ve = kc.encode(k, mean=k.mean(0)), vc.encode(v, mean=v.mean(0))
        err = np.abs(kc.logits(q, ke) - q @ k.T).mean()
        bound = kc.logit_error_bound(q, ke).mean()
        out = attention(q, ke, ve, kc, vc)
        rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
        print(f"{bits:>4} {kc.bytes_per_vector:>9} {kc.bytes_per_vector / (2 * a.dim):>8.3f} "
              f"{kc.expected_sq_angle_error:>9.4g} {err:>12.4g} {bound:>11.4g} {rel:>12.3e}")
    return 0


COMMAND_GROUP = "spherical_kv.commands"   # entry points: name -> main(argv) -> exit code


def _commands() -> dict:
    """The subcommands: ``demo`` here, and every entry point of ``COMMAND_GROUP`` (the
    evaluation registers ``evaluate``); the reference never imports the packages that
    register them."""
    from importlib.metadata import entry_points
    found = {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}
    found.pop("demo", None)
    return found


def main(argv=None) -> int:
    from . import __version__
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _commands()
    if argv and argv[0] == "--version":
        print(f"spherical-kv {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        # asked for, the help goes to stdout and succeeds; with no subcommand it is a usage
        # error, as argparse treats a missing required argument
        out = sys.stdout if argv else sys.stderr
        names = ["demo"] + sorted(commands)
        print(f"usage: spherical-kv [--version] {{{','.join(names)}}} [options]\n"
              "  demo      codec bytes, logit errors and bounds on random data", file=out)
        for name, ep in sorted(commands.items()):
            print(f"  {name:<9} from {ep.value.split(':')[0]} (spherical-kv {name} --help)",
                  file=out)
        if "evaluate" not in commands:
            print("  (evaluate: the real-model evaluation comes with the installed package, "
                  "pip install 'spherical-kv[eval]')", file=out)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        return demo(rest)
    if cmd in commands:
        return int(commands[cmd].load()(rest) or 0)
    print(f"spherical-kv: unknown command {cmd!r} (expected one of "
          f"{', '.join(['demo'] + sorted(commands))})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
