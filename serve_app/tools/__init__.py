"""What runs outside a replica: the `serve-app` CLI and its commands (building, calibrating and
importing models, rendering the KubeRay manifest, the ingress settings Ray starts with), and a
worker pod's drain hook. Nothing that serves imports this package."""
