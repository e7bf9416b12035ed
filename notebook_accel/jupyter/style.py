"""CSS and small HTML pieces shared by the launch panel and the hardware widget.

Colours come from JupyterLab's theme variables. The fallbacks are theme-neutral (inherit,
translucent grey, mid-tone hues) because Colab and classic Notebook define none of the variables
and may still be dark.
"""

from __future__ import annotations

import html
from typing import Optional

ERROR = "var(--jp-error-color1, #e5484d)"
SUCCESS = "var(--jp-success-color1, #2e9e4f)"
WARN = "var(--jp-warn-color1, #d9822b)"
BRAND = "var(--jp-brand-color1, #2f80ed)"
BORDER = "var(--jp-border-color2, rgba(127, 127, 127, 0.3))"
SHADE = "var(--jp-layout-color2, rgba(127, 127, 127, 0.08))"
CODE_FONT = "var(--jp-code-font-family, monospace)"

CSS = f"""
.nacc-launch, .nacc-hardware {{
  color: var(--jp-ui-font-color1, inherit);
  font-family: var(--jp-ui-font-family, inherit);
  font-size: var(--jp-ui-font-size1, 13px);
}}
.nacc-launch .nacc-title, .nacc-hardware .nacc-title {{ font-weight: 600; }}
.nacc-launch-status {{ margin-left: 0.8em; }}
.nacc-launch-mode {{
  margin-left: 0.6em; padding: 0 0.4em; border: 1px solid {BORDER}; border-radius: 3px; font-size: 0.9em;
}}
.nacc-launch [data-status="pending"] {{ opacity: 0.65; }}
.nacc-launch [data-status="running"] {{ color: {BRAND}; }}
.nacc-launch [data-status="done"] {{ color: {SUCCESS}; }}
.nacc-launch [data-status="failed"] {{ color: {ERROR}; font-weight: 600; }}
.nacc-launch [data-status="stopped"] {{ color: {WARN}; }}
.nacc-muted {{ opacity: 0.65; }}
.nacc-table {{ border-collapse: collapse; line-height: 1.5; margin: 0.2em 0; }}
.nacc-table th, .nacc-table td {{
  padding: 0.1em 0.9em 0.1em 0; text-align: left; vertical-align: middle;
  border-bottom: 1px solid {BORDER};
}}
.nacc-table th {{ font-weight: 600; opacity: 0.75; }}
.nacc-scroll {{
  display: flex; flex-direction: column-reverse; overflow-y: auto; max-height: 24em;
  background: {SHADE}; border: 1px solid {BORDER}; border-radius: 2px;
}}
.nacc-log {{
  flex-shrink: 0; overflow: visible;  /* grow past the box so the box scrolls, not the pre */
  margin: 0; padding: 0.4em 0.6em; background: transparent; color: inherit;
  font-family: {CODE_FONT}; font-size: var(--jp-code-font-size, 12px); line-height: 1.4;
  white-space: pre-wrap; overflow-wrap: anywhere;
}}
.nacc-prefix {{ font-weight: 600; }}
.nacc-err {{ background: rgba(229, 72, 77, 0.1); }}
.nacc-current {{ opacity: 0.75; }}
.nacc-note {{ opacity: 0.6; font-style: italic; }}
.nacc-traceback {{
  box-sizing: border-box; margin: 0.4em 0; padding: 0.4em 0.6em; line-height: 1.4;
  border: 1px solid {ERROR}; border-left-width: 4px; border-radius: 2px;
  background: rgba(229, 72, 77, 0.07);
}}
.nacc-traceback-summary {{ color: {ERROR}; font-weight: 600; }}
.nacc-traceback pre {{
  margin: 0.3em 0 0; max-height: 24em; overflow: auto; background: transparent; color: inherit;
  font-family: {CODE_FONT}; font-size: var(--jp-code-font-size, 12px); white-space: pre-wrap;
}}
.nacc-launch [data-stalled="1"] {{ color: {WARN}; font-weight: 600; }}
.nacc-stall {{
  box-sizing: border-box; margin: 0.4em 0; padding: 0.4em 0.6em; line-height: 1.4;
  border: 1px solid {WARN}; border-left-width: 4px; border-radius: 2px;
}}
.nacc-stall-sentence {{ color: {WARN}; font-weight: 600; }}
.nacc-stall pre {{
  margin: 0.3em 0 0; max-height: 24em; overflow: auto; background: transparent; color: inherit;
  font-family: {CODE_FONT}; font-size: var(--jp-code-font-size, 12px); white-space: pre-wrap;
}}
.nacc-section {{ font-weight: 600; margin: 0.7em 0 0.1em; }}
.nacc-bar {{
  display: inline-block; width: 12em; height: 0.8em; vertical-align: middle; margin-right: 0.5em;
  background: rgba(127, 127, 127, 0.22); border-radius: 2px; overflow: hidden;
}}
.nacc-bar-fill {{ display: block; height: 100%; background: {BRAND}; }}
.nacc-bar-fill.nacc-high {{ background: {WARN}; }}
.nacc-badge {{
  display: inline-block; padding: 0 0.4em; margin-right: 0.3em; line-height: 1.4;
  border: 1px solid currentColor; border-radius: 3px; font-size: 0.85em;
}}
.nacc-badge-on {{ color: {SUCCESS}; }}
.nacc-badge-off {{ opacity: 0.45; text-decoration: line-through; }}
.nacc-error {{ color: {ERROR}; }}
"""


def style_tag() -> str:
    return f"<style>{CSS}</style>"


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def rank_color(rank: int) -> str:
    """A hue per rank (golden-angle steps keep neighbours apart); mid lightness reads on light and dark."""
    return f"hsl({(rank * 137.508) % 360:.0f}, 65%, 50%)"


def bar(used: Optional[float], total: Optional[float], text: str) -> str:
    """An HTML usage bar followed by `text`; high usage is drawn in the warning colour."""
    if not total or used is None:
        return esc(text)
    share = min(max(used / total, 0.0), 1.0)
    high = " nacc-high" if share >= 0.9 else ""
    return (
        f'<span class="nacc-bar" title="{share:.0%}"><span class="nacc-bar-fill{high}" '
        f'style="width:{share * 100:.1f}%"></span></span>{esc(text)}'
    )


def badge(text: str, on: bool) -> str:
    state = "on" if on else "off"
    title = "supported" if on else "not supported"
    return f'<span class="nacc-badge nacc-badge-{state}" title="{text} {title}">{esc(text)}</span>'
