"""Load tests against a live server: open-loop Locust (`make loadtest`), latency against offered
load (sweep), and overload and soak (overload/)."""
