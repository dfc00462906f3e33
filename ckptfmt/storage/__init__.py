"""Where bytes live besides local paths: object stores (s3:// URLs) through boto3.

URL parsing (``urls``), the client and its error translation (``client``), the sparse
in-memory spool that lets the engine's fd-based writer and reader work on an object
(``spool``), the streaming multipart upload that commits an object (``upload``) and the
ranged, ETag-pinned download of the bytes a read needs (``download``).  boto3 is imported
only when a URL is used.

May import: ``ckptfmt.engine``, ``ckptfmt.format`` and the base modules.
"""
