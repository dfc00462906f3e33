/* Cryptographic chunk digests (spec/FORMAT.md section 16): SHA-256 through OpenSSL's
 * libcrypto (EVP, one context per thread), over a 72-byte context that binds the chunk
 * to its file and position, then the chunk's stored bytes.  Built without libcrypto
 * (CKF_HAVE_CRYPTO undefined), every function here fails and ckf_crypto_available()
 * says 0: the library then refuses signing with a clear error. */
#include <string.h>

#include "ckptfmt.h"

#ifdef CKF_HAVE_CRYPTO
#include <openssl/evp.h>

int ckf_crypto_available(void) { return 1; }

void *ckf_sha_new(void) { return EVP_MD_CTX_new(); }

void ckf_sha_free(void *ctx) {
    if (ctx) EVP_MD_CTX_free((EVP_MD_CTX *)ctx);
}

int ckf_sha_begin(void *ctx, const uint8_t *file_id, uint64_t index, uint64_t offset, uint64_t stored_len,
                  uint64_t raw_len, uint8_t codec, uint8_t filter, uint8_t width) {
    uint8_t c[72];
    memset(c, 0, sizeof c);
    memcpy(c, "ckptfmt-sha256", 14); /* followed by two zero bytes */
    memcpy(c + 16, file_id, 16);
    for (int i = 0; i < 8; i++) {
        c[32 + i] = (uint8_t)(index >> (8 * i));
        c[40 + i] = (uint8_t)(offset >> (8 * i));
        c[48 + i] = (uint8_t)(stored_len >> (8 * i));
        c[56 + i] = (uint8_t)(raw_len >> (8 * i));
    }
    c[64] = codec;
    c[65] = filter;
    c[66] = width;
    return EVP_DigestInit_ex((EVP_MD_CTX *)ctx, EVP_sha256(), NULL) == 1 &&
           EVP_DigestUpdate((EVP_MD_CTX *)ctx, c, sizeof c) == 1;
}

int ckf_sha_update(void *ctx, const uint8_t *p, uint64_t len) {
    return EVP_DigestUpdate((EVP_MD_CTX *)ctx, p, (size_t)len) == 1;
}

int ckf_sha_end(void *ctx, uint8_t *out) {
    unsigned int n = 0;
    return EVP_DigestFinal_ex((EVP_MD_CTX *)ctx, out, &n) == 1 && n == 32;
}

#else

int ckf_crypto_available(void) { return 0; }
void *ckf_sha_new(void) { return NULL; }
void ckf_sha_free(void *ctx) { (void)ctx; }
int ckf_sha_begin(void *ctx, const uint8_t *file_id, uint64_t index, uint64_t offset, uint64_t stored_len,
                  uint64_t raw_len, uint8_t codec, uint8_t filter, uint8_t width) {
    (void)ctx, (void)file_id, (void)index, (void)offset, (void)stored_len, (void)raw_len;
    (void)codec, (void)filter, (void)width;
    return 0;
}
int ckf_sha_update(void *ctx, const uint8_t *p, uint64_t len) {
    (void)ctx, (void)p, (void)len;
    return 0;
}
int ckf_sha_end(void *ctx, uint8_t *out) {
    (void)ctx, (void)out;
    return 0;
}

#endif
