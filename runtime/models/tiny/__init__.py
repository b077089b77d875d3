"""The shipped weights of the built-in `tiny-wan` model (`weights/`, a diffusers directory loaded
like a user checkpoint). How it is built, trained and judged lives in the `tiny_wan` package."""
