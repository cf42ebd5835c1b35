"""The router: HTTP ingress (a thin shell) and its policies (plain classes, no Ray)."""
