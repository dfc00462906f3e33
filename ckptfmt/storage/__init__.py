"""Where bytes live besides local paths: object stores (s3://, gs://, az:// and abfs:// URLs).

URL parsing (``urls``); the ``Store`` interface every store implements (``store``) and which
store serves a URL (``backends``): S3 through boto3 (``s3``), Google Cloud Storage's JSON API
(``gcs``) and Azure Blob Storage's REST API (``azure``) over requests (``http``); what every
store shares: options, retries, deadlines and the translation of failures (``client``); the
sparse in-memory spool that lets the engine's fd-based writer and reader work on an object
(``spool``), the streaming upload in parts that commits an object whole (``upload``) and the
ranged, version-pinned download of the bytes a read needs (``download``).  A store's client
package is imported only when a URL of its scheme is used.

May import: ``ckptfmt.engine``, ``ckptfmt.format`` and the base modules.
"""
