"""Bytes on media: object header, value codec, and the tiers' on-media layouts."""
