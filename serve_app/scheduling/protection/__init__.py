"""Overload and failure protection: class shedding on the router's loop delay (`overload`) and on a
model queue's standing delay (`standing`), the router's in-flight ceiling (`concurrency`), a model's
learned in-flight batch limit (`limit`) and its circuit breaker (`breaker`). Plain classes, no Ray."""
