/* The engine's cryptography, through OpenSSL's libcrypto (EVP, one context per thread):
 * SHA-256 chunk digests of signed files (spec/FORMAT.md section 16) and AES-256-GCM of
 * encrypted files' chunks (section 17).  Both start from a 72-byte context that binds the
 * chunk to its file and position (the digest hashes it first, GCM takes it as associated
 * data).  Built without libcrypto (CKF_HAVE_CRYPTO undefined), every function here fails
 * and ckf_crypto_available() says 0: the library then refuses both features with a clear
 * error. */
#include <string.h>

#include "ckptfmt.h"

/* the chunk context of spec sections 16.2 and 17.3: a 16-byte label, then the file id and the
 * chunk record's fields, little-endian */
static void chunk_context(uint8_t c[72], const char *label, const uint8_t *file_id, uint64_t index,
                          uint64_t offset, uint64_t stored_len, uint64_t raw_len, uint8_t codec, uint8_t filter,
                          uint8_t width) {
    memset(c, 0, 72);
    memcpy(c, label, strlen(label)); /* at most 15 bytes: zero-padded to 16 */
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
}

#ifdef CKF_HAVE_CRYPTO
#include <limits.h>
#include <openssl/evp.h>

int ckf_crypto_available(void) { return 1; }

void *ckf_sha_new(void) { return EVP_MD_CTX_new(); }

void ckf_sha_free(void *ctx) {
    if (ctx) EVP_MD_CTX_free((EVP_MD_CTX *)ctx);
}

int ckf_sha_begin(void *ctx, const uint8_t *file_id, uint64_t index, uint64_t offset, uint64_t stored_len,
                  uint64_t raw_len, uint8_t codec, uint8_t filter, uint8_t width) {
    uint8_t c[72];
    chunk_context(c, "ckptfmt-sha256", file_id, index, offset, stored_len, raw_len, codec, filter, width);
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

void *ckf_gcm_new(void) { return EVP_CIPHER_CTX_new(); }

void ckf_gcm_free(void *ctx) {
    if (ctx) EVP_CIPHER_CTX_free((EVP_CIPHER_CTX *)ctx);
}

int ckf_gcm_begin(void *ctx, int encrypt, const uint8_t *key, const uint8_t *file_id, uint64_t index,
                  uint64_t offset, uint64_t stored_len, uint64_t raw_len, uint8_t codec, uint8_t filter,
                  uint8_t width) {
    EVP_CIPHER_CTX *x = (EVP_CIPHER_CTX *)ctx;
    uint8_t nonce[12] = {0}; /* the chunk number, little-endian, then four zero bytes */
    for (int i = 0; i < 8; i++) nonce[i] = (uint8_t)(index >> (8 * i));
    uint8_t aad[72];
    chunk_context(aad, "ckptfmt-aes-gcm", file_id, index, offset, stored_len, raw_len, codec, filter, width);
    int n = 0;
    /* the default GCM nonce length is 12 bytes: no EVP_CTRL_GCM_SET_IVLEN needed */
    return EVP_CipherInit_ex(x, EVP_aes_256_gcm(), NULL, key, nonce, encrypt ? 1 : 0) == 1 &&
           EVP_CipherUpdate(x, NULL, &n, aad, (int)sizeof aad) == 1;
}

int ckf_gcm_update(void *ctx, uint8_t *out, const uint8_t *in, uint64_t len) {
    EVP_CIPHER_CTX *x = (EVP_CIPHER_CTX *)ctx;
    while (len) { /* EVP takes int lengths */
        int step = len > (uint64_t)(INT_MAX / 2) ? INT_MAX / 2 : (int)len;
        int n = 0;
        if (EVP_CipherUpdate(x, out, &n, in, step) != 1 || n != step) return 0;
        out += step;
        in += step;
        len -= (uint64_t)step;
    }
    return 1;
}

int ckf_gcm_finish(void *ctx, uint8_t *tag) {
    EVP_CIPHER_CTX *x = (EVP_CIPHER_CTX *)ctx;
    uint8_t none[16];
    int n = 0;
    if (EVP_CIPHER_CTX_encrypting(x))
        return EVP_CipherFinal_ex(x, none, &n) == 1 && EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_GET_TAG, 16, tag) == 1;
    /* decrypting: the expected tag first, then Final checks it (0 on a mismatch) */
    return EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_SET_TAG, 16, tag) == 1 && EVP_CipherFinal_ex(x, none, &n) == 1;
}

static int gcm_oneshot(int encrypt, const uint8_t *key, const uint8_t *nonce, const uint8_t *aad, uint64_t aad_len,
                       const uint8_t *in, uint64_t len, uint8_t *out, uint8_t *tag) {
    if (aad_len > (uint64_t)(INT_MAX / 2)) return 0;
    EVP_CIPHER_CTX *x = EVP_CIPHER_CTX_new();
    if (!x) return 0;
    int n = 0;
    /* the default GCM nonce length is 12 bytes */
    int ok = EVP_CipherInit_ex(x, EVP_aes_256_gcm(), NULL, key, nonce, encrypt) == 1 &&
             (aad_len == 0 || EVP_CipherUpdate(x, NULL, &n, aad, (int)aad_len) == 1) &&
             ckf_gcm_update(x, out, in, len) && ckf_gcm_finish(x, tag);
    EVP_CIPHER_CTX_free(x);
    return ok;
}

int ckf_gcm_seal(const uint8_t *key, const uint8_t *nonce, const uint8_t *aad, uint64_t aad_len, const uint8_t *in,
                 uint64_t len, uint8_t *out, uint8_t *tag) {
    return gcm_oneshot(1, key, nonce, aad, aad_len, in, len, out, tag);
}

int ckf_gcm_open(const uint8_t *key, const uint8_t *nonce, const uint8_t *aad, uint64_t aad_len, const uint8_t *in,
                 uint64_t len, uint8_t *out, uint8_t *tag) {
    return gcm_oneshot(0, key, nonce, aad, aad_len, in, len, out, tag);
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
void *ckf_gcm_new(void) { return NULL; }
void ckf_gcm_free(void *ctx) { (void)ctx; }
int ckf_gcm_begin(void *ctx, int encrypt, const uint8_t *key, const uint8_t *file_id, uint64_t index,
                  uint64_t offset, uint64_t stored_len, uint64_t raw_len, uint8_t codec, uint8_t filter,
                  uint8_t width) {
    uint8_t aad[72]; /* keeps chunk_context used in this build too */
    chunk_context(aad, "ckptfmt-aes-gcm", file_id, index, offset, stored_len, raw_len, codec, filter, width);
    (void)ctx, (void)encrypt, (void)key;
    return 0;
}
int ckf_gcm_update(void *ctx, uint8_t *out, const uint8_t *in, uint64_t len) {
    (void)ctx, (void)out, (void)in, (void)len;
    return 0;
}
int ckf_gcm_finish(void *ctx, uint8_t *tag) {
    (void)ctx, (void)tag;
    return 0;
}
int ckf_gcm_seal(const uint8_t *key, const uint8_t *nonce, const uint8_t *aad, uint64_t aad_len, const uint8_t *in,
                 uint64_t len, uint8_t *out, uint8_t *tag) {
    (void)key, (void)nonce, (void)aad, (void)aad_len, (void)in, (void)len, (void)out, (void)tag;
    return 0;
}
int ckf_gcm_open(const uint8_t *key, const uint8_t *nonce, const uint8_t *aad, uint64_t aad_len, const uint8_t *in,
                 uint64_t len, uint8_t *out, uint8_t *tag) {
    return ckf_gcm_seal(key, nonce, aad, aad_len, in, len, out, tag);
}

#endif
