"""Jupyter workbench for Varuna jobs (separate distribution `varuna-widgets`).

The workbench (controller-driven timelines, memory and job buttons) arrives with the workbench
issue; this package exists now so the layout and the dependency direction (widgets -> varuna,
never the reverse) are fixed from the start.
"""

__all__: list[str] = []
__version__ = "0.1.0"
