"""The cluster tests' Ray settings, set before any test module imports Ray (it reads them at import)."""
import os

# A DeploymentHandle reports its ongoing requests to Ray's autoscaler every 10 s by default; every 0.5 s here, so
# that the autoscaling test sees its load within seconds (the driver's handles read it; workers inherit it).
os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
