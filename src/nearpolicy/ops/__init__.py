"""Pure tensor math: no models, no config objects, no `.item()`."""
