"""Overload and failure protection: class shedding on the router's loop delay (`overload`), a
route's degrading on its heavy queue's standing delay (`degrade`), the router's in-flight ceiling (`concurrency`), a model's
learned in-flight batch limit (`limit`) and its circuit breaker (`breaker`). Plain classes, no Ray."""
