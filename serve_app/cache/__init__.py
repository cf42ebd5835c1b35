"""The router's response cache: keys over everything that decides an answer, a local LRU
bounded in bytes, and an optional shared Redis tier for several routers."""
