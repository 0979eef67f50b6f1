#!/usr/bin/env python3
"""Draw a memory snapshot (fsdp_allocator's Snapshot::write_pickle, or `fsdp train
--memory-snapshot FILE`) with PyTorch's own `torch.cuda._memory_viz trace_plot`, as a page
that works offline.

The page `_memory_viz` writes imports MemoryViz.js from a CDN, which in turn imports d3 from
another. This script inlines both: MemoryViz.js from `--memory-viz-js`, else
$FSDP_MEMORY_VIZ_JS, else the copy under the torch package's `torch/utils/viz/` when it ships
one; d3 (version 5, the UMD bundle `d3.min.js` of the npm package `d3@5`) from `--d3`, else
$FSDP_D3_JS. Without them the page keeps its CDN imports (and needs the network).

    python memory_viz_html.py SNAPSHOT -o out.html [--segments] [--memory-viz-js F] [--d3 F]
"""

import argparse
import os
import pickle
import re
import sys


def find_memory_viz_js(explicit):
    candidates = [explicit, os.environ.get("FSDP_MEMORY_VIZ_JS")]
    try:
        import torch.utils

        candidates.append(
            os.path.join(os.path.dirname(torch.utils.__file__), "viz", "MemoryViz.js")
        )
    except ImportError:
        pass
    for c in candidates:
        if c and os.path.isfile(c):
            return c
    return None


CDN_MODULE = re.compile(
    r'import\s*\{\s*add_local_files\s*\}\s*from\s*"https://[^"]*MemoryViz\.js";?'
)
D3_NAMESPACE = re.compile(r'import\s+\*\s+as\s+(\w+)\s+from\s+"https://[^"]*d3[^"]*";?')
D3_NAMED = re.compile(r'import\s*\{([^}]*)\}\s*from\s+"https://[^"]*d3[^"]*";?')


def inline(html, viz_js, d3_js):
    if d3_js is not None:
        viz_js = D3_NAMESPACE.sub(lambda m: f"const {m.group(1)} = window.d3;", viz_js)
        viz_js = D3_NAMED.sub(
            lambda m: "const {"
            + ", ".join(
                n.strip().replace(" as ", ": ") for n in m.group(1).split(",") if n.strip()
            )
            + "} = window.d3;",
            viz_js,
        )
    # The module's exports are plain declarations once inlined in the page's own module.
    viz_js = re.sub(r"^export\s+", "", viz_js, flags=re.M)
    page, n = CDN_MODULE.subn(lambda _m: viz_js.replace("</script", "<\\/script"), html)
    if n != 1:
        raise SystemExit("the _memory_viz page does not import MemoryViz.js as expected")
    if d3_js is not None:
        page = page.replace(
            "<head>", "<head>\n<script>\n" + d3_js.replace("</script", "<\\/script") + "\n</script>", 1
        )
    return page


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("snapshot")
    p.add_argument("-o", "--output", default="output.html")
    p.add_argument("-s", "--segments", action="store_true", help="plot segments, not blocks")
    p.add_argument("--memory-viz-js")
    p.add_argument("--d3")
    args = p.parse_args()
    from torch.cuda import _memory_viz

    with open(args.snapshot, "rb") as f:
        data = pickle.load(f)
    html = _memory_viz.trace_plot(data, plot_segments=args.segments)
    viz = find_memory_viz_js(args.memory_viz_js)
    if viz is None:
        print("MemoryViz.js not found: the page loads it from its CDN", file=sys.stderr)
    else:
        d3_path = args.d3 or os.environ.get("FSDP_D3_JS")
        d3_js = open(d3_path).read() if d3_path else None
        if d3_js is None:
            print("d3 not given: MemoryViz.js loads it from its CDN", file=sys.stderr)
        html = inline(html, open(viz).read(), d3_js)
    with open(args.output, "w") as f:
        f.write(html)


if __name__ == "__main__":
    main()
