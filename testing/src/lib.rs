//! Test writers for vmdisk's unit and integration tests: layers in formats no tool packaged for
//! these machines writes; and a registry front that redirects blobs to a blob host, as public
//! registries do ([`cdn`]); and a shaped link to put in front of them ([`link`]). Written apart from vmdisk's readers (they share no code), so a test
//! checks the reader against the format, not against itself. Test code: it panics on what it
//! cannot write.

pub mod cdn;
pub mod estargz;
pub mod link;

/// `sha256:<hex>` of `data`, as OCI spells digests.
pub fn sha256(data: &[u8]) -> String {
    use sha2::Digest as _;
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(data)))
}
