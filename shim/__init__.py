"""cpushim: a node-level CPU manager for Kubernetes on the CRI path."""

__version__ = "0.1.0"
